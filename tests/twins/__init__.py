"""Reference twins of the packed regions: padded implementations that only tests run."""
