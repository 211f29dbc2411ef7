"""Adapters that plug ckptzip into other engines' checkpointing (no manager of their own):
:mod:`.lightning` (PyTorch Lightning ``CheckpointIO``). Each saves and loads through the public
pipeline (:func:`ckptzip.save`, :func:`ckptzip.async_save`, :func:`ckptzip.load`)."""
