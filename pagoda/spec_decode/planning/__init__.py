"""pagoda.spec_decode.planning."""
