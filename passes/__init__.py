"""Compiler passes."""
