"""pagoda.spec_decode"""
