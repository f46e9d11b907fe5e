"""Chat templates: ``template`` (``ChatTemplate``, render limits, the checkpoint's generation
defaults), the bounded Jinja sandbox they render in (``sandbox``) and OpenAI-style chat messages as a
template reads them (``messages``). Nothing is imported here."""
