"""The `tandem` command line: one parser that dispatches to the engine, the operator and the tools.

    main.py   the `tandem` command: the engine (generate, serve), the operator, the tools (client,
              chat, demo, benchmarks); engine, serving and sampling flags generated from their
              config dataclasses
"""
