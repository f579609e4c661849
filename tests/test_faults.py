"""Adversarial tests (issue 14): every way ranks, checkpoints and the launcher can go wrong
must give a clear error, never a silent wrong value, code execution or a hang.

Sections (kept apart so they can grow independently):
1. SPMD safety: rank disagreement, shard_map checks, partial cotangents, small errors.
2. Checkpoint security and integrity, launcher hardening, install.
"""

# ==========================================================================================
# 1. SPMD safety: consistency mode, shard_map out_specs / varying axes, partial cotangents
# ==========================================================================================


# (section 1 ends here)


# ==========================================================================================
# 2. Checkpoints (safe loading, checksums, atomic saves) and the launcher
# ==========================================================================================


# (section 2 ends here)
