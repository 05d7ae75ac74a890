"""pagoda.entrypoints"""
