"""What comes out of a job: its assembled results, signed webhooks, usage per tenant and the metrics."""
