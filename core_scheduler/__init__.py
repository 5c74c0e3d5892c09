"""core_scheduler"""
