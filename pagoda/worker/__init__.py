"""pagoda.worker"""
