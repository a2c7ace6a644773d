"""The engine: requests admitted, then each step in phases (admit, propose, verify, accept,
retire), and `SpeculativeDecoder` over it. It drives models, proposers and the policy below."""
