"""variant_store"""
