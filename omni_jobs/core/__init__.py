"""What every layer stands on: settings, Redis keys and clients, errors, JSON types, logging and telemetry.

Nothing here knows a job, a pipeline or an engine.
"""
