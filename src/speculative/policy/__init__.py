"""How much to draft: measured forward costs, acceptance estimates, the adaptive K and the
node budget of token trees. It imports nothing else of `speculative`, so it can be tested alone."""
