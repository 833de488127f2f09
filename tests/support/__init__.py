"""What the tests share besides fixtures: imported as `support.<module>` (pyproject's pytest
`pythonpath` puts tests/ on the path), never from a test module or conftest."""
