"""The `tandem` command line: one parser that dispatches to the engine, the operator and the tools."""
