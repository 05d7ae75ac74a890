"""pagoda.executor"""
