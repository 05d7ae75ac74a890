"""pagoda.metrics"""
