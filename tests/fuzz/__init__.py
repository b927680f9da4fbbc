"""Property-based fuzzing of every loader: mutated inputs end in a result or a SailorError naming the file."""
