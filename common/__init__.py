"""What every layer of tandem may use: no imports from the rest of tandem, nothing beyond the
standard library.

    options.py   options as frozen dataclasses, each field its default and help; the command line's
                 flags generated from the fields
    stats.py     summary statistics (percentiles) for the benchmarks and the autoscaling simulation
    cpu.py       the CPU's flags, as the kernel and dtype choices need them; TANDEM_CPU_ISA=avx2 caps
                 them, torch's, oneDNN's and MKL's ISA and the kernels' (csrc/isa_cap.h) at AVX2: an
                 AVX2-only CPU measured on a larger one
"""
