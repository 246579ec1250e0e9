"""Models on the ``candidate_path`` product: Model B, the route sidecar on candidate
positions (:mod:`.model`, :mod:`.bench`), and its rows (:mod:`.rows`)."""
