"""The model step and what it stands on: `step.model_step` (the only place the model runs),
`attention` (write + attend over the KV state), `backends` (xla | pallas | pallas_interpret ->
kernel or reference), `sampling` (per-row settings as arrays)."""
