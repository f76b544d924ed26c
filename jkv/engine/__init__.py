"""The serving engine's host side: page pool, sequences, scheduler (plain Python on ints)."""
