"""einfold inside other libraries.  Each submodule imports its library, so import
the one you use: `compiler.integrations.transformers` (Hugging Face transformers)."""
