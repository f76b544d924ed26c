"""The serving engine: page pool, sequences and scheduler (plain Python on ints), the runner
(the pool's arrays and the paged model step) and `Engine` (add_request / step / abort)."""
