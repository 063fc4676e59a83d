"""Training jobs: datasets stored as token shards, job records, checkpoints, training
placement and the Jobs/TrainingStore RPCs. `coordinator.jobs.service:build` wires it in.

Kept import-free: coordinator.migrations imports `coordinator.jobs.schema`.
"""
