"""What runs beside the engine: the local PD stack and demo, the benchmarks, a gRPC client."""
