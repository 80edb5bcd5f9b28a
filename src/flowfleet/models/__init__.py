"""DiT experts and routers.

config.py  DiTConfig and the DiT size presets (light: no torch model code)
dit.py     DiTModel / DiTExpert / DiTRouter (diffusers ModelMixin)
files.py   save_model / load_model for diffusers-style model folders
"""
