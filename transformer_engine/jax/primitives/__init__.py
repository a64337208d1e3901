"""JAX primitives of transformer_engine.jax (fused attention forward and backward)."""
