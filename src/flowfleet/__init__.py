"""flowfleet: decentralized flow-matching diffusion fleets and patch-parallel inference."""

__version__ = "0.1.0"
