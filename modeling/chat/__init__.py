"""Chat templates: ``template`` (``ChatTemplate``, render limits, the checkpoint's generation
defaults) and the bounded Jinja sandbox they render in (``sandbox``). Nothing is imported here."""
