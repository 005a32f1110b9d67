"""Per-rank cost of parallel training: what each rank of a parallel plan computes, holds and sends."""
