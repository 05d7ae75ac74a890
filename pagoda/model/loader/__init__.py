"""pagoda.model.loader"""
