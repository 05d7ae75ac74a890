"""pagoda.engine"""
