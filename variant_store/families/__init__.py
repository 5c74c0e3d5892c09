"""variant_store/families"""
