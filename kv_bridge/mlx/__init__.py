"""MLX side of the KV bridge: received KV -> mlx-lm cache objects (the only mlx code outside backends/)."""
