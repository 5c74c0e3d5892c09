"""variant_store/runtimes"""
