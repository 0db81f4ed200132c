"""The OpenAI API's request side, shared by router and engines: `request` validates the
generation fields in OpenAI's documented ranges (one validator, so both refuse alike), `tools`
the `tools` / `tool_choice` fields and the tool-call answers."""
