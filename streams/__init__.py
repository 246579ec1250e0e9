"""Topic catalogue, broker control, the runtime publisher and stream processors."""
