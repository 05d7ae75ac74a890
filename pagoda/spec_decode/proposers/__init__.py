"""pagoda.spec_decode.proposers."""
