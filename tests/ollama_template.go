// Renders chat requests through the TEMPLATE of an exported Ollama Modelfile, the way Ollama does.
//
//	go run tests/ollama_template.go MODELFILE REQUESTS.json > RENDERED.json
//
// REQUESTS.json is a list of {"messages": [...], "tools": [...]} in the shape of Ollama's /api/chat
// (tool-call arguments as JSON objects). The output is a JSON list with the prompt Ollama would feed the
// model for each request, before it generates. Used by tests/test_export.py.
//
// Written for this project after reading Ollama's template/template.go and api/types.go (no Ollama code
// is imported, so this runs with Go's standard library alone): the same text/template options and
// functions, the same data the chat path passes (System, Messages collated as Ollama collates them,
// Tools, Response ""), and Go types whose JSON encoding follows Ollama's api types: struct field order,
// omitempty, insertion-ordered tool-call arguments and tool properties, and encoding/json's compact,
// HTML-escaping output.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"text/template"
	"text/template/parse"
	"time"
)

// orderedMap keeps a JSON object's keys in the order they came, as Ollama's orderedmap does.
type orderedMap[V any] struct {
	keys   []string
	values map[string]V
}

func (m *orderedMap[V]) UnmarshalJSON(data []byte) error {
	m.keys, m.values = nil, map[string]V{}
	decoder := json.NewDecoder(bytes.NewReader(data))
	if token, err := decoder.Token(); err != nil || token != json.Delim('{') {
		return fmt.Errorf("expected a JSON object, got %s", data)
	}
	for decoder.More() {
		token, err := decoder.Token()
		if err != nil {
			return err
		}
		key := token.(string)
		var value V
		if err := decoder.Decode(&value); err != nil {
			return err
		}
		if _, seen := m.values[key]; !seen {
			m.keys = append(m.keys, key)
		}
		m.values[key] = value
	}
	_, err := decoder.Token()
	return err
}

func (m orderedMap[V]) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, key := range m.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(key)
		v, err := json.Marshal(m.values[key])
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// The api types, with Ollama's field order and JSON tags.

type ToolCallFunctionArguments struct{ om *orderedMap[any] }

func (t *ToolCallFunctionArguments) UnmarshalJSON(data []byte) error {
	t.om = &orderedMap[any]{}
	return json.Unmarshal(data, t.om)
}

func (t ToolCallFunctionArguments) MarshalJSON() ([]byte, error) {
	if t.om == nil {
		return []byte("{}"), nil
	}
	return json.Marshal(t.om)
}

type ToolCallFunction struct {
	Index     int                       `json:"index"`
	Name      string                    `json:"name"`
	Arguments ToolCallFunctionArguments `json:"arguments"`
}

type ToolCall struct {
	ID       string           `json:"id,omitempty"`
	Function ToolCallFunction `json:"function"`
}

type Message struct {
	Role       string     `json:"role"`
	Content    string     `json:"content"`
	Thinking   string     `json:"thinking,omitempty"`
	ToolCalls  []ToolCall `json:"tool_calls,omitempty"`
	ToolName   string     `json:"tool_name,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
}

// PropertyType is a JSON Schema type: one string, or a list of them.
type PropertyType []string

func (pt *PropertyType) UnmarshalJSON(data []byte) error {
	var one string
	if err := json.Unmarshal(data, &one); err == nil {
		*pt = []string{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(data, &many); err != nil {
		return err
	}
	*pt = many
	return nil
}

func (pt PropertyType) MarshalJSON() ([]byte, error) {
	if len(pt) == 1 {
		return json.Marshal(pt[0])
	}
	return json.Marshal([]string(pt))
}

type ToolPropertiesMap struct{ om *orderedMap[ToolProperty] }

func (t *ToolPropertiesMap) UnmarshalJSON(data []byte) error {
	t.om = &orderedMap[ToolProperty]{}
	return json.Unmarshal(data, t.om)
}

func (t ToolPropertiesMap) MarshalJSON() ([]byte, error) {
	if t.om == nil {
		return []byte("null"), nil
	}
	return json.Marshal(t.om)
}

type ToolProperty struct {
	AnyOf       []ToolProperty     `json:"anyOf,omitempty"`
	Type        PropertyType       `json:"type,omitempty"`
	Items       any                `json:"items,omitempty"`
	Description string             `json:"description,omitempty"`
	Enum        []any              `json:"enum,omitempty"`
	Properties  *ToolPropertiesMap `json:"properties,omitempty"`
	Required    []string           `json:"required,omitempty"`
}

type ToolFunctionParameters struct {
	Type       string             `json:"type"`
	Defs       any                `json:"$defs,omitempty"`
	Items      any                `json:"items,omitempty"`
	Required   []string           `json:"required,omitempty"`
	Properties *ToolPropertiesMap `json:"properties"`
}

type ToolFunction struct {
	Name        string                 `json:"name"`
	Description string                 `json:"description,omitempty"`
	Parameters  ToolFunctionParameters `json:"parameters"`
}

type Tool struct {
	Type     string       `json:"type"`
	Items    any          `json:"items,omitempty"`
	Function ToolFunction `json:"function"`
}

type Request struct {
	Messages []Message `json:"messages"`
	Tools    []Tool    `json:"tools"`
}

// The functions Ollama gives templates (toTypeScriptType reduced to the one-type case).
var funcs = template.FuncMap{
	"json": func(v any) string {
		b, _ := json.Marshal(v)
		return string(b)
	},
	"currentDate":   func(args ...string) string { return time.Now().Format("2006-01-02") },
	"yesterdayDate": func(args ...string) string { return time.Now().AddDate(0, 0, -1).Format("2006-01-02") },
	"toTypeScriptType": func(v any) string {
		p, ok := v.(ToolProperty)
		if !ok || len(p.Type) != 1 {
			return "any"
		}
		switch p.Type[0] {
		case "string", "boolean", "null":
			return p.Type[0]
		case "number", "integer":
			return "number"
		case "array":
			return "any[]"
		case "object":
			return "Record<string, any>"
		}
		return "any"
	},
}

// modelfileTemplate is the text between TEMPLATE """ and the next """, as Ollama's Modelfile parser reads it.
func modelfileTemplate(modelfile string) (string, error) {
	const open = `TEMPLATE """`
	start := strings.Index(modelfile, open)
	if start < 0 {
		return "", errors.New(`no TEMPLATE """...""" in the Modelfile`)
	}
	rest := modelfile[start+len(open):]
	end := strings.Index(rest, `"""`)
	if end < 0 {
		return "", errors.New(`the Modelfile's TEMPLATE """ is never closed`)
	}
	return rest[:end], nil
}

// refersTo says whether the template names a field anywhere: Ollama renders the whole conversation in one
// go (the chat path) only when the template refers to .Messages.
func refersTo(node parse.Node, field string) bool {
	switch n := node.(type) {
	case *parse.ListNode:
		for _, c := range n.Nodes {
			if refersTo(c, field) {
				return true
			}
		}
	case *parse.ActionNode:
		return refersTo(n.Pipe, field)
	case *parse.IfNode:
		return refersTo(&n.BranchNode, field)
	case *parse.RangeNode:
		return refersTo(&n.BranchNode, field)
	case *parse.WithNode:
		return refersTo(&n.BranchNode, field)
	case *parse.BranchNode:
		return refersTo(n.Pipe, field) || refersTo(n.List, field) || (n.ElseList != nil && refersTo(n.ElseList, field))
	case *parse.PipeNode:
		for _, c := range n.Cmds {
			for _, a := range c.Args {
				if refersTo(a, field) {
					return true
				}
			}
		}
	case *parse.FieldNode:
		for _, ident := range n.Ident {
			if strings.EqualFold(ident, field) {
				return true
			}
		}
	}
	return false
}

// collate joins the system messages and merges consecutive messages of one role (tool results excepted).
func collate(messages []Message) (string, []*Message) {
	var system []string
	var collated []*Message
	for i := range messages {
		if messages[i].Role == "system" {
			system = append(system, messages[i].Content)
		}
		if n := len(collated); n > 0 && collated[n-1].Role == messages[i].Role && messages[i].Role != "tool" {
			collated[n-1].Content += "\n\n" + messages[i].Content
		} else {
			collated = append(collated, &messages[i])
		}
	}
	return strings.Join(system, "\n\n"), collated
}

func run(modelfilePath, requestsPath string) error {
	modelfile, err := os.ReadFile(modelfilePath)
	if err != nil {
		return err
	}
	text, err := modelfileTemplate(string(modelfile))
	if err != nil {
		return fmt.Errorf("%s: %w", modelfilePath, err)
	}
	tmpl, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(text)
	if err != nil {
		return fmt.Errorf("%s: the TEMPLATE does not parse: %w", modelfilePath, err)
	}
	if !refersTo(tmpl.Tree.Root, "Messages") {
		return fmt.Errorf("%s: the TEMPLATE never uses .Messages, so Ollama would render it turn by turn", modelfilePath)
	}
	raw, err := os.ReadFile(requestsPath)
	if err != nil {
		return err
	}
	var requests []Request
	if err := json.Unmarshal(raw, &requests); err != nil {
		return fmt.Errorf("%s: %w", requestsPath, err)
	}
	rendered := []string{}
	for i, request := range requests {
		system, messages := collate(request.Messages)
		var b bytes.Buffer
		err := tmpl.Execute(&b, map[string]any{
			"System":      system,
			"Messages":    messages,
			"Tools":       request.Tools,
			"Response":    "",
			"Think":       false,
			"IsThinkSet":  false,
			"Query":       "",
			"Document":    "",
			"Instruction": "",
		})
		if err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
		rendered = append(rendered, b.String())
	}
	return json.NewEncoder(os.Stdout).Encode(rendered)
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: go run ollama_template.go MODELFILE REQUESTS.json")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2]); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
