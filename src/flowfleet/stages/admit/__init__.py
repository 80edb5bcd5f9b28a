"""`flowfleet admit RUN_ROOT PKG --trusted KEYS`: the gate a contributed expert passes before it serves anyone.

The checks run in this order, one module each, and the first failure refuses the package in one line,
`refused (CHECK): FILE: why` (Refused); nothing of the run changes until the last one passes:

  signature.py      manifest.json (64 KiB at most) and manifest.sig (an Ed25519 signature's 64 bytes) read from where
                    the package lies, regular files only, and the signature checked by a key on the owner's list
                    before a byte of the manifest is parsed; the manifest's schema; the kit it was made from one this
                    fleet issued (a random fleet identity is part of every kit: another fleet's kit of the same
                    contract is another kit); a manifest this run holds or once held refused, naming the expert it
                    became; then the private copy (package.py): every file the manifest lists, a regular file never
                    followed through a link, each under its cap from the issued kit, hashed as it is copied against
                    its signed sha256
  files.py          safetensors and JSON only; every safetensors header bounded and its offsets checked before a
                    tensor is read; config.json a DiT's, its parameters counted from its numbers within the issued
                    kit's cap before anything is built; the weights its tensors, in an allowed dtype, finite
  compatibility.py  the fleet's latent space, text interface, time convention and objectives; only what an expert may
                    change; the issued kit still the run's contract; a sample and held-out slice of the fleet's shape
                    and the kit's rows that are not the fleet's own data
  learning.py       on its own held-out slice: a lower loss with flowfleet's time convention than reversed, below an
                    untrained expert's, close to its loss on its sample and to the training loss it signed; its
                    velocities on the fleet's held-out latents finite and bounded
  no_harm.py        the grown fleet (installed from the private copy, its router trained warm-started, assembled into
                    model-candidate/): no harm on the fleet's held-out data by the routed loss and, where a judge
                    reads the fleet's prompts, by the images; better on the contribution's held-out slice

Every check after the signature's, and the install, read the private copy only: the bytes checked are the bytes
installed. Then the expert joins: run.yaml records the contribution (signer, manifest digest), model/ is assembled
with it, its folder keeps the signed manifest (listed in SHA256SUMS, compared with the installed files by `flowfleet
verify`), card.json names the signer. A refused package leaves run.yaml, model/ and every job folder as they were.
docs/contributing-experts.md gives the threat model and the costs' bounds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import posixpath
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flowfleet.config import load_run_config
from flowfleet.errors import FlowfleetError
from flowfleet.layout import CONTRIBUTIONS, MODEL
from flowfleet.stages.admit.compatibility import check_compatibility
from flowfleet.stages.admit.files import check_files
from flowfleet.stages.admit.gate import Gate
from flowfleet.stages.admit.learning import check_learning
from flowfleet.stages.admit.losses import expert_velocity, flow_loss
from flowfleet.stages.admit.no_harm import changed_first, check_no_harm
from flowfleet.stages.admit.refusal import Refused
from flowfleet.stages.admit.settings import GateSettings
from flowfleet.stages.admit.signature import check_signature, copy_package
from flowfleet.stages.assemble import assemble
from flowfleet.storage import RunRoot

__all__ = ["AdmitResult", "GateSettings", "Refused", "admit", "changed_first", "expert_velocity", "flow_loss"]

log = logging.getLogger(__name__)


@dataclass
class AdmitResult:
    expert: int  # its number in the grown fleet
    signer: str  # key id
    manifest_sha256: str
    model: str  # the re-assembled model folder
    figures: dict[str, float] = field(default_factory=dict)  # every loss the gate measured
    grid: str | None = None  # reports/contributions/expert_<k>.png: the judged samples before and after

    def lines(self) -> list[str]:
        return [f"{k}: {v:.4f}" for k, v in self.figures.items()]


def admit(
    run_root: str,
    package: str,
    trusted: str,
    *,
    settings: GateSettings = GateSettings(),
    progress: bool = True,
    picture: str | None = None,
) -> AdmitResult:
    """Check a contributed expert's package against the run (the module docstring's five checks, in order), and
    on success grow the fleet with it; a Refused names the first check that failed.
    picture: a PNG file to write the judged samples to as well, on a refusal too (the run stays unchanged then)."""
    settings.validate()
    root, pkg = RunRoot(run_root), RunRoot(package)
    if not root.exists(MODEL):
        raise FlowfleetError(f"{root.url_of(MODEL)}: missing; the gate compares against the assembled fleet")
    with tempfile.TemporaryDirectory(prefix="flowfleet-admit-") as private:
        gate = Gate(root, load_run_config(root), Path(private), settings)
        try:
            gate.signed = gate.run("signature", lambda: check_signature(pkg, trusted, root, gate.cfg))
            gate.run("signature", lambda: copy_package(pkg, gate.sign, gate.staged))
            log.info("admit: signature: passed (signed by %s, copied)", gate.sign.signer)
            checks = (("files", check_files), ("compatibility", check_compatibility), ("learning", check_learning))
            for name, check in checks:
                gate.run(name, functools.partial(check, gate))
                log.info(f"admit: {name}: passed")
            k = gate.run("no harm", lambda: check_no_harm(gate, pkg.url, progress))
        finally:
            if picture and gate.grid is not None:
                folder, name = posixpath.split(picture)
                RunRoot(folder or ".").write_bytes(gate.grid, name)
    log.info("admit: no harm: passed")
    result = assemble(root.url, progress=progress)
    grid = None
    if gate.grid is not None:
        root.write_bytes(gate.grid, *CONTRIBUTIONS, f"expert_{k}.png")
        grid = root.url_of(*CONTRIBUTIONS, f"expert_{k}.png")
    digest = hashlib.sha256(gate.sign.body).hexdigest()
    return AdmitResult(k, gate.sign.signer, digest, result.out, dict(gate.figures), grid)
