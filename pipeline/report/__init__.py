"""What people read: the validate report in Markdown, its figures, and the model card."""
