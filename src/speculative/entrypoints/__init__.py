"""The front-ends: `EngineArgs` (one set of engine options) and the `speculative` commands
(generate, serve, batch, bench, train, export). Nothing below imports from here."""
