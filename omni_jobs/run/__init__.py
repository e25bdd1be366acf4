"""A worker running one attempt of a stage: the attempt (lease, limits, settle), its inputs and outputs, the
engine call, what it reports while it runs (progress, previews, streamed text and audio) and its cache."""
