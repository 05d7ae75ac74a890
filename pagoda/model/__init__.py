"""pagoda.model"""
