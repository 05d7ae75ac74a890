"""pagoda.sample"""
