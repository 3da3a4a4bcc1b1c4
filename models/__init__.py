"""Example models built on pallas_flash: a byte-level transformer, its data and training."""
