"""Candidate-path replay: drafters propose paths at an anchor, the teacher labels them.

The design note's second replay product (``replay-decode-as-prefill.md``, "Candidate-path
replay"): at a committed anchor a drafter proposes W candidate paths of depth B; the
teacher runs every path causally on top of the once-prefilled committed prefix and
records its native route at every candidate position and routed layer; verification
under the recorded sampling configuration gives each path's accepted prefix length.
Rejected suffixes are kept as rows but never enter clean-path state.
"""
