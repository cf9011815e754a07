"""engine-dtensor."""
