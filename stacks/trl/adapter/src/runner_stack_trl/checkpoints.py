"""Checkpoint completeness: a marker written last, atomically, once the Trainer has saved everything."""

from __future__ import annotations

from pathlib import Path

from runner_contracts import COMPLETE_MARKER, sha256_file, write_atomic

def completion_marker():
    """A TrainerCallback that writes checkpoint-N/COMPLETE ("N <sha256 of model.safetensors>") on save."""
    from transformers import TrainerCallback

    class CompletionMarker(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            digest = sha256_file(path / "model.safetensors")
            write_atomic(path / COMPLETE_MARKER, f"{state.global_step} {digest}\n".encode())
            return control

    return CompletionMarker()
