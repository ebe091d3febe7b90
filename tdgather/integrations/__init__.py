"""Layer 5, other libraries' hooks: Lightning's prediction writer, and the Hugging Face ``datasets`` export."""
