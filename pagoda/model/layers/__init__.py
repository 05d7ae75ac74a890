"""pagoda.model.layers"""
