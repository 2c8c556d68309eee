"""What the machine can do, read once at start-up (CPU flags today)."""
