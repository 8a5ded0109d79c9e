"""The schedule as data: per-lane task lists with explicit dependencies, a builder, a validator,
text dumps and timeline export."""
