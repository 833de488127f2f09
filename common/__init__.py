"""What every layer of tandem may use: no imports from the rest of tandem, nothing beyond the
standard library."""
